package figures

// Figure is a formatter registered under the name its markers use.
type Figure struct {
	Name string
	// About says what the figure is and what its command costs.
	About string
	// Format turns the command's output into the figure's Markdown.
	Format func(Output) (string, error)
}

// Registry is every figure kvbench figures knows, in the order of
// BENCHMARKS.md.
func Registry() []Figure {
	return []Figure{
		{"users-feel", "goodput at an SLO and TTFT at a rate: round-robin, gaie (its own code), kv, kv-pooled on seed 002's shape and both Mooncake traces (~15 min)",
			formatUsersFeel},
		{"s002-calibration", "simulator calibration against seed 002 (round-robin, 4 runs, ~1 s)", formatS002Calibration},
		{"s001-calibration", "simulator calibration against seed 001 (2 runs, ~1 s)", formatS001Calibration},
		{"s002-grid", "the whole seed-002 grid, every policy (24 runs, ~30 s)", formatS002Grid},
		{"s002-approx", "seed 002's approximate-mode column beside ours (6 runs, ~5 s)", formatApproxColumn},
		{"disagg-seed001", "kvbench disagg: seed 001's arithmetic (shares disagg-1p1d's command, ~5 s)", formatDisaggSeed001},
		{"disagg-1p1d", "kvbench disagg: 1 + 1 workers, concurrency 4 (~5 s)", formatDisaggGrid},
		{"disagg-2p2d", "kvbench disagg: 2 + 2 workers, 16 clients with think time (~10 s)", formatDisaggGrid},
		{"s002-seeds", "seed 002's acceptance cell seed by seed, kv-pooled now, 6 and 3 workers, seeds 11–22 (24 runs, ~10 s)", formatS002Seeds},
		{"s002-hardest", "seed 002's 24-prefix cells against kv's 36-setting knob sweep, best settings picked (222 runs, ~2 min)",
			formatS002Hardest},
		{"pooled-grid", "the seed-002 grid, round-robin, kv and kv-pooled (24 runs, ~40 s)", formatPooledGrid},
		{"beyond-s002", "skew, a moving hot set, heterogeneous workers, sessions: round-robin, kv, best kv scale, kv-pooled (24 runs, ~30 s)",
			formatBeyondS002},
		{"wide-grid", "kv against kv-pooled on 3–32 workers, outputs 16–1,024 tokens (50 runs, ~3 min)", formatWideGrid},
		{"sensitivity", "kv-pooled's constants one at a time on 8 cells, sessions included (80 runs, ~2 min)", formatSensitivity},
		{"wait-price", "kv-pooled's expected-wait price at weights 0, 1, 0.3 and 0.1 on the wide grid's 256- and 1,024-token cells (80 runs, ~5 min)",
			formatWaitPrice},
		{"wait-price-s002", "kv-pooled's expected-wait price at weights 0, 1 and 0.1 on seed 002's 24-prefix cells (18 runs, ~15 s)",
			formatWaitPriceS002},
		{"routers-s002", "several routers against sync lag, seed 002's 24-prefix cell (10 runs, ~30 s)",
			formatRouters("r*.json", " (0 – 3 s)", "", true)},
		{"routers-live", "several routers against sync lag, the live workload's shape (14 runs, ~20 s)",
			formatRouters("S*.json", "", "  ", false)},
	}
}
