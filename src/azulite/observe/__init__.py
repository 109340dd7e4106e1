"""What operators watch: alert rules (one renderer for every part), output drift statistics."""
