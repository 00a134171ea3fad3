"""fedpeft's tests, in folders that mirror ``src/fedpeft`` (config/, data/, models/,
metrics/, methods/, engines/, flower/, report/, cli/) plus benchmarks/ for the benchmark
scripts; the top-level modules' tests (exports, sweeps, the synthetic example, the
package's layout) sit here. Fixtures: ``conftest.py``; helpers shared by modules:
``helpers/``. A package, so that modules of the same name in two folders do not clash."""
