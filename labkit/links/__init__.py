"""Links between ranks: an emulated slow link (in process), a real one (tc netem between namespaces), and measuring bandwidth against the alpha-beta cost model."""
