"""The Gradio page: the chat, the worker panel, the speed plots, in the browser's language.

Its chat function talks to the dispatcher only, exactly as the API does.
"""
