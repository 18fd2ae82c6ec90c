"""Temper's control plane: the Django project (settings, URLs, ASGI) and its apps."""
