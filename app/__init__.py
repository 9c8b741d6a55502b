"""The serving process: dispatcher, OpenAI-style API and Gradio page on one event loop."""
