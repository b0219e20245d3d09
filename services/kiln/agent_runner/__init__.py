"""The agent runner: compilations (the Compiler API), agents, budgets, best-so-far."""
