"""One path's pipeline in TrialWorkflow: the steps every trial kind shares, the path's typed
state, its ledger bookkeeping and the activity types every kind uses."""
