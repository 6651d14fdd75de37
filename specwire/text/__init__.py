"""Text in and out: chat templates, reasoning sections, incremental detokenizing and
tool-call formats; no model, no engine."""
