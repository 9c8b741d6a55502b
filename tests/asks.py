"""Questions the tests ask the bundled model, chosen for a clear greedy answer on every kernel.

``CAPITAL``: "What is the capital of France?" is a near tie for SmolLM2-135M: its first token is "The"
(then "... is Paris.") by 0.03-0.25 logits over "L"/"La" (then "L'Étoile de la Cité ..."),
so an int8 kernel, a thread count or a prompt split at a cached prefix can flip it. The
phrasing below wins by 1.25 logits or more on every kernel in ``workers.decoders.lean.kernels``.

``LONG``: a reply that is still being written when a test stops or crowds it. Greedy, the
model writes on to the 1,024-token limit on every kernel (measured); "Count from 1 to 500."
(or 1000) stops itself after 121 tokens, about 2 s, which a slow moment can outlast.

``LINES``: a reply of several lines, for stop strings. "Count from 1 to 10, one number per
line." is written on one line by the onnxruntime graph at the app's repetition penalty (1.05),
and as prose by fbgemm; this one is "1. Bananas\n2. Oranges\n3. Grapes" on every kernel and
on the graph, with penalty 1.0 or 1.05, whole or prefilled in two pieces, on 1 or 2 threads.

``EXAMPLE_ANSWERS``: the page's examples (``app.page.ui.EXAMPLES``) and a phrase of each one's greedy
answer, which stops by itself in 7-80 tokens on the lean decoder (int8-ort, 1 thread) and on
the graph (2 threads), with penalty 1.0 or 1.05 (measured). Tried and dropped for rambling to
the token limit or for wrong answers: "What is the capital of France?", a haiku about a CPU
(or about autumn), "用中文介绍一下你自己。" (answered in English), a KV cache or a fun fact about
cats explained, a poem about the sea, "What is 12 plus 7?" ("9"), the largest planet ("Neptune"),
"good morning" in French ("Je m'aime…"), a name for a goldfish (none given), three tips for
sleeping better (fine at 1.05, "Snooze, Snooze, …" at 1.0).

``QUOTED``: a text a reply quotes (``tests/test_speculation.py``, ``tests/test_e2e.py``): the
start of CPython's own help on ``assert`` (``pydoc_data``), which the bundled model repeats,
greedy, on the graph and on the lean decoder; prompt-lookup speculation drafts it.
"""

import pydoc_data.topics

QUOTED = pydoc_data.topics.topics["assert"][:700]
CAPITAL = "Name the capital of France."  # greedy: "The capital of France is Paris."
LONG = "Write a long essay about the history of the Roman Empire."  # greedy: 1,024 tokens and more
LINES = "Name three fruits as a numbered list."  # greedy: "1. Bananas\n2. Oranges\n3. Grapes"
EXAMPLE_ANSWERS = {
    CAPITAL: "Paris",
    LINES: "1. Bananas",
    "Explain photosynthesis in one sentence.": "carbon dioxide",  # "... converts carbon dioxide into ..."
    "What is a CPU?": "Central Processing Unit",
}

# A tool call's ask, in the docs' tool example and tests/test_tools.py: with tool_choice
# "required" the grammar makes any reply a valid call, so what is checked is the call's shape.
WEATHER = "What is the weather like in Paris?"
