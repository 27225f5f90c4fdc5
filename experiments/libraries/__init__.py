"""Training steps of real libraries (MaxText, keras-hub, gemma) built tiny, for the planner to be judged on their own code."""
