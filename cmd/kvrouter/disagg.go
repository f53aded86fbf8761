package main

import "github.com/kvrouter/kvrouter/cmd/internal/disaggflag"

// disaggFlags are --disagg and its knobs as `kvrouter serve` flags. The
// settings and their parsing live in cmd/internal/disaggflag, shared with
// kvbench disagg; the replica routes by them (internal/replica/disagg.go).
func disaggFlags(c *disaggflag.Settings) []flagSpec {
	var specs []flagSpec
	for _, f := range c.Flags() {
		specs = append(specs, flagSpec{names: f.Names, env: f.Env, def: f.Default, usage: f.Usage, set: f.Set, bool: f.Bool})
	}
	return specs
}
