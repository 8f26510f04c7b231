"""Test helpers that ship with autosoft: the family conformance suite (`conformance`)."""
