"""The HTTP edge: what crosses the wire to and from a client.

The API's routes and their wire formats (chat-completions in ``api``; each other client's
dialect in ``dialects``, all on the one internal request of ``turn``), the errors in the
client's shape, who may call (``auth``), what strangers' connections get (``guards``), the
limits every request is checked against, and ``/metrics``. Nothing here knows a worker: it
hands the dispatcher one internal request and writes back what streams out of it.
"""
