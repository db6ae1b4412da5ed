"""Keeping the table and storage in step: flushing, seeding, recovery, roll-over, the node
id's claim."""
