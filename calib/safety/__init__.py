"""Run safety, checked before anything expensive: where outputs may go and how they are written atomically
(outputs), and the run options that are not part of a recipe (options)."""
