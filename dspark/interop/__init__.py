"""Interop with other stacks: drafter folder formats read, exports written, `dspark inspect`."""
