"""llama.cpp's own server beside this app, by job: ``build`` llama.cpp once, ``convert``
checkpoints to GGUF, ``measure`` every server with one client, ``report`` the tables.
``benchmarks.llama_anchor`` runs them in that order (``python -m benchmarks anchor``).
"""
