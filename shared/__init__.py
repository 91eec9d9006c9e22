"""What two or more recipes share, as plain functions; why each works around a library: docs/troubleshooting.md."""
