"""The run's OS processes, as every launcher, node agent and training process sees them: who a process is and how
it is fenced (``fence``), how the run ends with its launcher (``lifeline``), the fork server's mechanism
(``forkserver``) and the malloc settings every long-lived process starts with (``malloc``). Imports nothing of the
planes, the agent or the worker."""
