"""The project's model of its job protocol: one job's life, checked breadth-first.

See docs/design/protocol.md, "What the model checks".
"""
