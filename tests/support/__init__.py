"""Test support (no tests here): doubles of external libraries, multi-process harnesses, shared cases and model builders."""
