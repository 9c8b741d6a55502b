"""The wire formats other clients speak, beside OpenAI's chat-completions (``app.edge.api``).

Each is a module of its own with one way in, ``routes(edge) -> APIRouter``: its request models
(an unknown field refused by name, in its own error shape: ``app.edge.errors.shaped_errors``),
their translation to the one internal request (``app.edge.turn.Turn``), and its writer of
``app.edge.turn``'s pieces, whole or streamed. The dispatcher and the workers learn nothing new.

    anthropic     POST /v1/messages, /v1/messages/count_tokens     (Claude Code, the anthropic SDK)
    responses     POST /v1/responses, stateless                    (Codex CLI, openai's responses.create)
    completions   POST /v1/completions, the raw prompt             (older code, evaluation harnesses)
    ollama        /api/chat, /api/generate, /api/tags, /api/show…  (Copilot, Open WebUI, the ollama client)
"""
