"""Transactions after the call: reconciling unknown outcomes, cancellation and compensation.
Owns: the states a call passes through once its answer is in doubt or undone. Must never: turn an
unknown into a success or failure without evidence."""
