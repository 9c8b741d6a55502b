"""Dispatch: which worker serves a request, who waits, and in what order.

``Dispatcher`` leases a worker's slot per request and gives each request its own channel;
``policy`` picks the worker (least loaded, sticky to the one holding a conversation's KV
cache, ``routing``); ``fairness`` keeps one caller from shutting the others out.
"""
