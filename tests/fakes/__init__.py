"""Stand-ins for optional native packages, injected by tests through `sys.modules`."""
