"""Run safety, checked before anything expensive: where outputs may go and how they are written atomically
(outputs), the run options that are not part of a recipe (options), and the typed readers that check
another process's JSON field by field with one error grammar (readers)."""
