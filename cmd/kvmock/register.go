package main

import (
	"log/slog"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus/registrar"
)

// registrationConfig is how the worker registers with the replicas
// (--register, the eventbus/registrar client). Serve fills in the URL: it
// knows the bound address.
func registrationConfig(cfg config, engCfg engine.Config, log *slog.Logger) registrar.Config {
	return registrar.Config{
		URLs:     cfg.Register,
		Token:    cfg.AdminToken,
		Interval: cfg.RegisterInterval,
		Logger:   log, // the client: registrar's default, 5 s timeout
		Spec: registrar.Spec{
			ID: cfg.ID, Model: cfg.Model, BlockSize: cfg.BlockSize,
			TotalBlocks: cfg.KVBlocks, MaxBatchedTokens: engCfg.MaxBatchedTokens,
			Role:    string(cfg.Role), // always sent: a router that predates roles ignores it
			DPRanks: registeredRanks(cfg.DPRanks),
		},
		// At shutdown a replica's "worker not registered" (an expired
		// lease) is as good as done.
		LenientDeregister: true,
	}
}
