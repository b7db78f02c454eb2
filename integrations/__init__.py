"""Integrations: adapters for other training frameworks, installed as ``gradwatch.integrations``.

Each integration is imported lazily by its user (``gradwatch.integrations.<name>``) so that
``import gradwatch`` never pulls in a heavy optional dependency.
"""
