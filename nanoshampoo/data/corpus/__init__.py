"""The embedded public-domain corpus files (gzip JSON lines); see README.md here."""
