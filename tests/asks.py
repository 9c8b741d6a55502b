"""Questions the tests ask the bundled model, chosen for a clear greedy answer on every kernel.

"What is the capital of France?" is a near tie for SmolLM2-135M: its first token is "The"
(then "... is Paris.") by 0.03-0.25 logits over "L"/"La" (then "L'Étoile de la Cité ..."),
so an int8 kernel, a thread count or a prompt split at a cached prefix can flip it. The
phrasing below wins by 1.25 logits or more on every kernel in ``workers.kernels``.
"""

CAPITAL = "Name the capital of France."  # greedy: "The capital of France is Paris."
