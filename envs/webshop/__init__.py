"""WebShop text environment (see env.py)."""
