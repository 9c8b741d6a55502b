"""What a request asks of the model and how the reply is read back, for page and API alike.

A ``response_format`` or ``tools`` becomes a grammar and a system turn on the way in; tool
calls and a reasoning model's thinking are split out of the streamed text on the way out.
"""
