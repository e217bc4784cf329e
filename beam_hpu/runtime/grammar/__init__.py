"""The response grammar's token bitmask on the logits' device."""
