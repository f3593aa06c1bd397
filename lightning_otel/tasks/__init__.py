"""Task packs (floor 3, beside rollouts): everything task-specific, so the generic layers hold none of it.
`spider` (text-to-SQL on SQLite databases) and `math` (numeric answers) ship here; see
lightning_otel.rollouts.packs for what a pack is and how to write your own.
"""
