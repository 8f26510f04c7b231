"""Test helpers that ship with autosoft: the family conformance suite (`conformance`) and the GPU
tests' shared compile pool (`compiling`)."""
