"""The container-toolkit stage's parts: runtime configurations, their transactions, and the CDI spec."""
