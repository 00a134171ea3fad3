"""Task metrics, spread across clients, and communication accounting."""
