"""Where the workers run: local processes (``local``) or Ray actors (``cluster``).

``backends.pool_factory`` is the one place that picks; both pools expose the same calls to
the dispatcher.
"""
