"""Dashboards: viewers of recorded runs, installed as ``gradwatch.dashboards``."""
