"""``mlscale ui``: one read-only web page over run directories, the registry and live servers.

``runs`` reads run directories (as they grow; down-sampled for the page), ``registry`` the model registry,
``serving`` scrapes servers' own metrics, ``app`` is the ASGI app and its JSON API, ``server`` checks the
settings and runs it; ``static/`` is the page (plain JavaScript and the charting asset, built by ``web/``).
"""
