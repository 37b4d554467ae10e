"""Operator tests (a package so pytest never names a module `operator.*`)."""
