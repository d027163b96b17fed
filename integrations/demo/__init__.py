"""``kiln demo``: kiln's real job in miniature (``story``) — a repository becomes an image, its tests become rewards,
a model learns from them — and ``kiln demo basics``, the runtime's tour on the echo and sleep stages (``basics``).
Not a stage: it drives the stages through their client facades, like any trainer."""
