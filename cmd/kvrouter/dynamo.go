package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/router"
)

// Dynamo's router flags and environment names, so a Dynamo launch line or
// environment works unchanged (testdata/dynamo-names.tsv lists every name with
// the upstream file it comes from; TestDynamoNames checks each against this
// file). Each name either has Dynamo's meaning here or is accepted with a
// one-line startup warning that says it has no effect and why — never
// "flag provided but not defined", never silently ignored.

// dynamoSpecs are the Dynamo names not already in parseServe's own specs.
// c is the config being built; warn records a startup warning.
func dynamoSpecs(c *serveConfig, noEvents *bool, warn func(string)) []flagSpec {
	// noEffect accepts a valued flag whose feature we do not have.
	noEffect := func(name, env, why string) flagSpec {
		return flagSpec{names: []string{name}, env: envs(env), usage: "Dynamo's; no effect here: " + why,
			set: func(v string) error {
				warn(fmt.Sprintf("--%s=%s has no effect here: %s", name, v, why))
				return nil
			}}
	}
	// negatable is Dynamo's --x / --no-x pair (and env). same is the value
	// that is already our behaviour (no warning); the other one has no
	// effect here, for the reason why.
	negatable := func(name, env string, same bool, why string, obsolete ...string) []flagSpec {
		set := func(given string) func(string) error {
			return func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return err
				}
				if b != same {
					warn(fmt.Sprintf("--%s=%v has no effect here: %s", given, b, why))
				}
				return nil
			}
		}
		specs := []flagSpec{{names: append([]string{name}, obsolete...), env: envs(env), bool: true,
			usage: "Dynamo's; here always " + strconv.FormatBool(same), set: set(name)}}
		no := []string{"no-" + name}
		for _, o := range obsolete {
			no = append(no, "no-"+o)
		}
		specs = append(specs, flagSpec{names: no, bool: true, usage: "Dynamo's; see --" + name,
			set: func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return err
				}
				return set("no-" + name)(strconv.FormatBool(!b))
			}})
		return specs
	}
	specs := []flagSpec{
		{names: []string{"router-kv-overlap-score-weight"}, env: []string{"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT"},
			usage: "deprecated Dynamo spelling of --router-prefill-load-scale", set: func(v string) error {
				warn("--router-kv-overlap-score-weight is deprecated (also in Dynamo): use --router-prefill-load-scale; applied as it")
				return floatp(&c.Router.PrefillLoadScale)(v)
			}},
		{names: []string{"router-kv-events", "kv-events"}, env: []string{"DYN_ROUTER_USE_KV_EVENTS", "DYN_KV_EVENTS"}, bool: true,
			usage: "consume worker KV events (default; --no-router-kv-events: approximate mode)", set: func(v string) error {
				b, err := strconv.ParseBool(v)
				if err == nil && !b {
					*noEvents = true
				}
				return err
			}},
		{names: []string{"no-kv-events"}, bool: true, usage: "alias of --no-router-kv-events", set: boolp(noEvents)},
		{names: []string{"router-track-prefill-tokens"}, env: []string{"DYN_ROUTER_TRACK_PREFILL_TOKENS"}, bool: true,
			usage: "count prompt tokens in the load (default true)", set: boolp(&c.Router.TrackPrefillTokens)},
		{names: []string{"load-aware"}, env: []string{"DYN_ROUTER_LOAD_AWARE"}, bool: true,
			usage: "Dynamo's load-aware preset: --router-mode load-aware", set: func(v string) error {
				b, err := strconv.ParseBool(v)
				if err == nil && b {
					c.Router.Mode = router.ModeLoadAware
				}
				return err
			}},
		{names: []string{"router-snapshot-threshold"}, env: []string{"DYN_ROUTER_SNAPSHOT_THRESHOLD"},
			usage: "Raft log entries between snapshots (Dynamo: stream messages between snapshots)", set: func(v string) error {
				n, err := strconv.ParseUint(v, 10, 64)
				if err == nil && n == 0 {
					err = fmt.Errorf("must be positive")
				}
				c.SnapshotThreshold = n
				return err
			}},
		{names: []string{"router-min-initial-workers"}, env: []string{"DYN_ROUTER_MIN_INITIAL_WORKERS"},
			usage: "not ready until this many workers are registered", set: func(v string) error {
				n, err := strconv.Atoi(v)
				if err == nil && n < 0 {
					err = fmt.Errorf("must not be negative")
				}
				c.MinInitialWorkers = n
				return err
			}},
		{names: []string{"admission-control"}, env: []string{"DYN_ADMISSION_CONTROL"},
			usage: "token-capacity (busy thresholds on, Dynamo's defaults for those not set) or none", set: func(v string) error {
				if v != "none" && v != "token-capacity" {
					return fmt.Errorf("want token-capacity or none, got %q", v)
				}
				c.AdmissionControl = v
				return nil
			}},
		{names: []string{"router-kv-overlap-score-credit-decay"}, env: []string{"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY"},
			usage: "shrink the overlap credit of a worker with more active prefill than the least loaded eligible one: credit/(1 + decay·excess blocks/prompt blocks) (Dynamo's; 0 = off)",
			set:   floatp(&c.Router.OverlapCreditDecay)},
		{names: []string{"router-decode-active-request-weight"}, env: []string{"DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT"},
			usage: "blocks of cost per request a worker is decoding (Dynamo's; 0 = off)",
			set:   floatp(&c.Router.DecodeActiveRequestWeight)},
		{names: []string{"router-host-cache-hit-weight"}, env: []string{"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"},
			usage: "credit, in blocks, per block a worker holds in its host-memory offload tier past its GPU prefix (Dynamo's; default 0.75; 0 = off). The bridge publishes host-tier events with --kv-tiers host",
			set:   floatp(&c.Router.HostCacheHitWeight)},
		{names: []string{"router-disk-cache-hit-weight"}, env: []string{"DYN_ROUTER_DISK_CACHE_HIT_WEIGHT"},
			usage: "credit per block held in a disk or external offload tier past the GPU and host prefix (Dynamo's; default 0.25; 0 = off). The bridge publishes them with --kv-tiers disk,external",
			set:   floatp(&c.Router.DiskCacheHitWeight)},
		noEffect("shared-cache-multiplier", "DYN_SHARED_CACHE_MULTIPLIER", "no external shared cache (HiCache/Mooncake) is queried"),
		noEffect("shared-cache-type", "DYN_SHARED_CACHE_TYPE", "no external shared cache (HiCache/Mooncake) is queried"),
		noEffect("router-prefill-load-model", "DYN_ROUTER_PREFILL_LOAD_MODEL", "prompt load is booked statically until the first token (Dynamo's 'none')"),
		noEffect("router-max-tree-size", "DYN_ROUTER_MAX_TREE_SIZE", "the index is bounded by the workers' own eviction events, not a tree size"),
		noEffect("router-prune-target-ratio", "DYN_ROUTER_PRUNE_TARGET_RATIO", "the index is bounded by the workers' own eviction events, not pruning"),
		noEffect("router-event-threads", "DYN_ROUTER_EVENT_THREADS", "events are applied through Raft in log order; there is no indexer thread pool"),
		noEffect("router-policy-config", "DYN_ROUTER_POLICY_CONFIG", "one queue per model (--router-queue-threshold, --router-queue-policy)"),
		noEffect("router-approximate-cache-policy", "DYN_ROUTER_APPROXIMATE_CACHE_POLICY", "approximate mode expires predictions by --router-ttl-secs only"),
		noEffect("router-predicted-ttl-secs", "DYN_ROUTER_PREDICTED_TTL_SECS", "routing decisions are always predicted, replicated and expired by the cluster's own rule"),
		noEffect("router-conditional-prefill-max-new-tokens", "DYN_ROUTER_CONDITIONAL_PREFILL_MAX_NEW_TOKENS", "use --disagg auto, which compares both TTFT estimates per request"),
	}
	specs = append(specs, negatable("router-replica-sync", "DYN_ROUTER_REPLICA_SYNC", true,
		"replicas always share their bookings over NATS core (the load view of several replicas needs it)")...)
	specs = append(specs, negatable("router-durable-kv-events", "DYN_ROUTER_DURABLE_KV_EVENTS", true,
		"KV events are always durable here (JetStream, acknowledged after the Raft commit)", "durable-kv-events")...)
	specs = append(specs, negatable("router-track-active-blocks", "DYN_ROUTER_TRACK_ACTIVE_BLOCKS", true,
		"active blocks are always tracked: the cost function needs them", "track-active-blocks")...)
	specs = append(specs, flagSpec{names: []string{"router-track-output-blocks", "track-output-blocks"}, env: envs("DYN_ROUTER_TRACK_OUTPUT_BLOCKS"), bool: true,
		usage: "grow a worker's active blocks as its requests stream: one block per block of output, decayed toward nvext.agent_hints.osl (default false)",
		set:   boolp(&c.Router.TrackOutputBlocks)},
		flagSpec{names: []string{"no-router-track-output-blocks", "no-track-output-blocks"}, bool: true, usage: "Dynamo's; see --router-track-output-blocks",
			set: func(v string) error {
				b, err := strconv.ParseBool(v)
				c.Router.TrackOutputBlocks = err == nil && !b
				return err
			}})
	specs = append(specs, flagSpec{names: []string{"router-assume-kv-reuse", "assume-kv-reuse"}, env: envs("DYN_ROUTER_ASSUME_KV_REUSE"), bool: true,
		usage: "requests sharing a prefix on a worker share its active blocks (default true; --no-router-assume-kv-reuse: every request's blocks count on their own)",
		set: func(v string) error {
			b, err := strconv.ParseBool(v)
			c.Router.DistinctActiveBlocks = err == nil && !b
			return err
		}},
		flagSpec{names: []string{"no-router-assume-kv-reuse", "no-assume-kv-reuse"}, bool: true, usage: "Dynamo's; see --router-assume-kv-reuse",
			set: func(v string) error {
				b, err := strconv.ParseBool(v)
				c.Router.DistinctActiveBlocks = err == nil && b
				return err
			}})
	specs = append(specs, negatable("router-reset-states", "DYN_ROUTER_RESET_STATES", false,
		"the index is replicated state: wiping it at one replica's start would wipe every replica's; deregister workers instead")...)
	specs = append(specs, negatable("use-remote-indexer", "DYN_USE_REMOTE_INDEXER", false,
		"every replica holds the whole index (replicated through Raft)")...)
	specs = append(specs, negatable("router-conditional-prefill", "DYN_ROUTER_CONDITIONAL_PREFILL", false,
		"use --disagg auto, which compares both TTFT estimates per request")...)
	specs = append(specs, negatable("router-conditional-disagg", "DYN_ROUTER_CONDITIONAL_DISAGG", false,
		"use --disagg auto, which compares both TTFT estimates per request")...)
	specs = append(specs, negatable("enforce-disagg", "DYN_ENFORCE_DISAGG", false,
		"a request that cannot be disaggregated is served aggregated, counted in kvrouter_disagg_decisions_total{outcome=\"fallback\"} (not implemented yet)")...)
	return specs
}

func envs(e string) []string {
	if e == "" {
		return nil
	}
	return []string{e}
}

// parseDynamoMode reads --router-mode, including Dynamo's modes we route
// differently: each one warns once at start.
func parseDynamoMode(v string, warn func(string)) (router.Mode, error) {
	switch v {
	case "device-aware-weighted", "device_aware_weighted":
		warn("--router-mode device-aware-weighted: routed as least-loaded (workers carry no device type here)")
		return router.ModeLeastLoaded, nil
	case "direct":
		warn("--router-mode direct: routed by the cost function (kv); a client-chosen worker is not supported")
		return router.ModeKV, nil
	}
	return router.ParseMode(v)
}

// isNone is Dynamo's literal for "no threshold" on the command line.
func isNone(v string) bool { return strings.EqualFold(v, "none") }
