import sys

try:
    from normatlas.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing: no traceback either
    print("normatlas: interrupted", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
