"""The planner (``--plan``): a run's memory per device and its time, per stage, from the config alone."""
