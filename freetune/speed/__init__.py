"""Speed features as plug-ins (filled in below)."""
