"""Emulate: identical hardware made to behave like slower devices (a test and demo aid); a null object when off."""
