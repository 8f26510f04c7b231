from .cli import main

if __name__ == "__main__":  # spawned helper processes import this module without running the CLI
    raise SystemExit(main())
