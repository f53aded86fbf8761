package main

import (
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// Dynamo's router flags and environment names, so a Dynamo launch line or
// environment works unchanged (testdata/dynamo-names.tsv lists every name
// with the upstream file it comes from and what it does here; TestDynamoNames
// checks each row against the configuration the replica would build its
// routers with). Each name does exactly one of three things:
//
//   - same: it asks for what kvrouter already does; accepted in silence.
//   - changes: Dynamo's meaning, applied to the configuration.
//   - warns: it would change nothing here (a feature we do not have, or a
//     knob the chosen mode does not read), so it is accepted with one startup
//     warning that names it and says why — never "flag provided but not
//     defined", never silently ignored.
//
// A knob some modes do not read (--router-temperature with round-robin,
// --router-ttl-secs with events) is checked after parsing, once the mode is
// final (dynamoState.apply).

// dynamoState is what the Dynamo names leave for after parsing: which
// source set each knob, and the switches that depend on the final mode.
type dynamoState struct {
	// src is the source being applied now: "--flag" (a bool flag alone),
	// "--flag=value" or "ENV=value" (config.go's parse loop sets it), so a
	// warning names what the operator wrote.
	src string
	// given maps a spec's key (its first name, or first environment name)
	// to the source that set it; defaults are not in it.
	given map[string]string
	// noEvents is the source that turned KV events off ("" = on).
	noEvents string
	// loadAware is the source of Dynamo's --load-aware preset ("" = not given).
	loadAware string
}

func (d *dynamoState) warnf(warn func(string), format string, a ...any) {
	warn(d.src + " " + fmt.Sprintf(format, a...))
}

// specKey names a spec in dynamoState.given.
func specKey(sp flagSpec) string {
	if len(sp.names) > 0 {
		return sp.names[0]
	}
	return sp.env[0]
}

// dynamoSpecs are the Dynamo names not already in parseServe's own specs.
// c is the config being built; warn records a startup warning.
func dynamoSpecs(c *serveConfig, d *dynamoState, warn func(string)) []flagSpec {
	// noEffect accepts a valued name whose feature we do not have: every
	// value warns.
	noEffect := func(name, env, why string) flagSpec {
		return flagSpec{names: names(name), env: envs(env), usage: "Dynamo's; no effect here: " + why,
			set: func(v string) error {
				d.warnf(warn, "has no effect here: %s", why)
				return nil
			}}
	}
	// choice accepts a valued name whose values in same are already our
	// behaviour (silent) and whose other values have no effect here (warn).
	// allowed, when not nil, are all the values Dynamo accepts; others are
	// refused, as Dynamo refuses them.
	choice := func(name, env string, same, allowed []string, why string) flagSpec {
		return flagSpec{names: names(name), env: envs(env), usage: fmt.Sprintf("Dynamo's; here always %s (%s)", strings.Join(same, "/"), why),
			set: func(v string) error {
				if allowed != nil && !slices.Contains(allowed, v) {
					return fmt.Errorf("want one of %s, got %q", strings.Join(allowed, ", "), v)
				}
				if !slices.Contains(same, v) {
					d.warnf(warn, "has no effect here: %s", why)
				}
				return nil
			}}
	}
	// negatable is Dynamo's --x / --no-x pair (and env). same is the value
	// that is already our behaviour (silent); the other one has no effect
	// here, for the reason why.
	negatable := func(name, env string, same bool, why string, obsolete ...string) []flagSpec {
		set := func(negated bool) func(string) error {
			return func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return err
				}
				if b != negated != same {
					d.warnf(warn, "has no effect here: %s", why)
				}
				return nil
			}
		}
		no := []string{"no-" + name}
		for _, o := range obsolete {
			no = append(no, "no-"+o)
		}
		return []flagSpec{
			{names: append([]string{name}, obsolete...), env: envs(env), bool: true, usage: "Dynamo's; here always " + strconv.FormatBool(same), set: set(false)},
			{names: no, bool: true, usage: "Dynamo's; see --" + name, set: set(true)},
		}
	}
	// pair is Dynamo's --x / --no-x pair (and env) for a bool we implement.
	pair := func(name string, env []string, usage string, set func(bool), obsolete ...string) []flagSpec {
		apply := func(negated bool) func(string) error {
			return func(v string) error {
				b, err := strconv.ParseBool(v)
				if err != nil {
					return err
				}
				set(b != negated)
				return nil
			}
		}
		no := []string{"no-" + name}
		for _, o := range obsolete {
			no = append(no, "no-"+o)
		}
		return []flagSpec{
			{names: append([]string{name}, obsolete...), env: env, bool: true, usage: usage, set: apply(false)},
			{names: no, bool: true, usage: "Dynamo's; see --" + name, set: apply(true)},
		}
	}
	const disaggWhy = "use --disagg auto, which compares both TTFT estimates per request"
	specs := []flagSpec{
		// Deprecated in Dynamo (which maps it the same way: the scale, and
		// a weight of 0 also turns the overlap credit off). Applied in
		// silence: the name keeps working here after Dynamo drops it.
		{names: []string{"router-kv-overlap-score-weight", "kv-overlap-score-weight"},
			env:   []string{"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT", "DYN_KV_OVERLAP_SCORE_WEIGHT"},
			usage: "deprecated Dynamo spelling of --router-prefill-load-scale (0 also sets --router-kv-overlap-score-credit 0, as in Dynamo)",
			set: func(v string) error {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					return err
				}
				c.Router.PrefillLoadScale = f
				if f == 0 {
					c.Router.OverlapCredit = 0
				}
				return nil
			}},
		{names: []string{"router-kv-overlap-score-credit-decay"}, env: []string{"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY"},
			usage: "shrink the overlap credit of a worker with more active prefill than the least loaded eligible one: credit/(1 + decay·excess blocks/prompt blocks) (Dynamo's; 0 = off)",
			set:   floatp(&c.Router.OverlapCreditDecay)},
		{names: []string{"router-decode-active-request-weight"}, env: []string{"DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT"},
			usage: "blocks of cost per request a worker is decoding (Dynamo's; 0 = off)",
			set:   floatp(&c.Router.DecodeActiveRequestWeight)},
		{names: []string{"router-host-cache-hit-weight"}, env: []string{"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"},
			usage: "kv mode: credit, in blocks, per block a worker holds in its host-memory offload tier past its GPU prefix (Dynamo's; default 0.75; 0 = off). The bridge publishes host-tier events with --kv-tiers host",
			set:   floatp(&c.Router.HostCacheHitWeight)},
		{names: []string{"router-disk-cache-hit-weight"}, env: []string{"DYN_ROUTER_DISK_CACHE_HIT_WEIGHT"},
			usage: "kv mode: credit per block held in a disk or external offload tier past the GPU and host prefix (Dynamo's; default 0.25; 0 = off). The bridge publishes them with --kv-tiers disk,external",
			set:   floatp(&c.Router.DiskCacheHitWeight)},
		{names: []string{"router-snapshot-threshold"}, env: []string{"DYN_ROUTER_SNAPSHOT_THRESHOLD"},
			usage: "Raft log entries between snapshots (Dynamo, before it dropped the name: stream messages between snapshots)", set: func(v string) error {
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
		// Dynamo's embedded router drops an in-flight request from the
		// load view after this long (environment only there too).
		{env: []string{"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS"}, set: func(v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || !(f > 0) {
				return fmt.Errorf("want a positive number of seconds, got %q", v)
			}
			c.Router.RequestExpiry = time.Duration(f * float64(time.Second))
			return nil
		}},
		// Dynamo's load-aware preset; applied after parsing, over
		// --router-mode, as Dynamo applies it (dynamoState.apply).
		{names: []string{"load-aware"}, env: []string{"DYN_ROUTER_LOAD_AWARE"}, bool: true,
			usage: "Dynamo's load-aware preset: --router-mode load-aware, no overlap credit, every request's blocks its own (no KV reuse assumed), prompt tokens tracked", set: func(v string) error {
				b, err := strconv.ParseBool(v)
				d.loadAware = ""
				if b {
					d.loadAware = d.src
				}
				return err
			}},
		{names: []string{"no-load-aware"}, bool: true, usage: "Dynamo's; see --load-aware", set: func(v string) error {
			b, err := strconv.ParseBool(v)
			if b {
				d.loadAware = ""
			}
			return err
		}},
		// Removed from Dynamo (its busy thresholds are independent now):
		// both values are ignored there with a warning, and here.
		{names: []string{"admission-control"}, env: []string{"DYN_ADMISSION_CONTROL"},
			usage: "Dynamo's, removed there: ignored; set the --active-*-threshold* flags directly", set: func(v string) error {
				if v != "none" && v != "token-capacity" {
					return fmt.Errorf("want token-capacity or none, got %q", v)
				}
				d.warnf(warn, "has no effect here, as in Dynamo, which removed it: set --active-decode-blocks-threshold, --active-prefill-tokens-threshold and --active-prefill-tokens-threshold-frac directly (token-capacity's former presets: 1.0, 10000000, 64)")
				return nil
			}},
		choice("router-tracking-hash", "DYN_ROUTER_TRACKING_HASH", []string{"public-xxh3-v1"}, []string{"public-xxh3-v1", "keyed-xxh3-v1"},
			"active-sequence identities are the public block hashes; keyed (provider-secret) tracking hashes are not implemented"),
		noEffect("router-tracking-key-file", "DYN_ROUTER_TRACKING_KEY_FILE", "keyed tracking hashes are not implemented (--router-tracking-hash keyed-xxh3-v1)"),
		noEffect("router-tracking-key-id", "DYN_ROUTER_TRACKING_KEY_ID", "keyed tracking hashes are not implemented (--router-tracking-hash keyed-xxh3-v1)"),
		choice("router-prefill-load-model", "DYN_ROUTER_PREFILL_LOAD_MODEL", []string{"none"}, []string{"none", "aic"},
			"prompt load is booked statically until the first token (Dynamo's 'none'); there is no AIC model"),
		choice("router-approximate-cache-policy", "DYN_ROUTER_APPROXIMATE_CACHE_POLICY", []string{"ttl"}, []string{"ttl", "lru"},
			"approximate mode expires predictions by --router-ttl-secs only (Dynamo's 'ttl')"),
		choice("shared-cache-type", "DYN_SHARED_CACHE_TYPE", []string{"none"}, []string{"none", "hicache"},
			"no external shared cache (HiCache/Mooncake) is queried"),
		noEffect("shared-cache-multiplier", "DYN_SHARED_CACHE_MULTIPLIER", "no external shared cache (HiCache/Mooncake) is queried"),
		choice("router-prefill-policy", "DYN_ROUTER_PREFILL_POLICY", []string{"default"}, nil,
			"there are no named worker-selection policies: the built-in cost function ('default') chooses"),
		choice("router-decode-policy", "DYN_ROUTER_DECODE_POLICY", []string{"default"}, nil,
			"there are no named worker-selection policies: the built-in cost function ('default') chooses"),
		{env: []string{"DYN_ROUTER_WORKER_SELECTION_POLICY"}, set: func(v string) error {
			if v != "default" {
				d.warnf(warn, "has no effect here: there are no named worker-selection policies: the built-in cost function ('default') chooses")
			}
			return nil
		}},
		noEffect("router-policy-config", "DYN_ROUTER_POLICY_CONFIG", "one queue per model (--router-queue-threshold, --router-queue-policy) and the built-in selector"),
		// Session affinity (issue 28; internal/replica/sessions.go): the
		// idle TTL turns it on; bindings are replicated state, so the
		// binding one replica makes is the one every replica uses.
		{names: names("router-session-affinity-ttl-secs"), env: envs("DYN_ROUTER_SESSION_AFFINITY_TTL_SECS"),
			usage: "bind a session (X-Dynamo-Session-ID, the coding agents' headers, nvext.session_control, prompt_cache_key) to a worker for this idle TTL, 1 to 31536000 seconds, on every replica (default: off)",
			set: func(v string) error {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil || n < 1 || n > 31536000 {
					return fmt.Errorf("want whole seconds from 1 to 31536000, got %q", v)
				}
				c.Sessions.TTL = time.Duration(n) * time.Second
				return nil
			}},
		{names: names("router-session-affinity-mode"), env: envs("DYN_ROUTER_SESSION_AFFINITY_MODE"),
			usage: "hard (default): a bound session's turns go to its worker only; soft: its worker is preferred while it is not busy, else the session is rebound",
			set: func(v string) error {
				switch v {
				case "hard", "soft":
					c.Sessions.Soft = v == "soft"
					return nil
				}
				return fmt.Errorf("want one of hard, soft, got %q", v)
			}},
		noEffect("router-max-tree-size", "DYN_ROUTER_MAX_TREE_SIZE", "the index is bounded by the workers' own eviction events, not a tree size"),
		noEffect("router-prune-target-ratio", "DYN_ROUTER_PRUNE_TARGET_RATIO", "the index is bounded by the workers' own eviction events, not pruning"),
		noEffect("router-event-threads", "DYN_ROUTER_EVENT_THREADS", "events are applied through Raft in log order; there is no indexer thread pool"),
		noEffect("router-predicted-ttl-secs", "DYN_ROUTER_PREDICTED_TTL_SECS", "routing decisions are always predicted, replicated and expired by the cluster's own rule"),
		noEffect("router-conditional-prefill-max-new-tokens", "DYN_ROUTER_CONDITIONAL_PREFILL_MAX_NEW_TOKENS", disaggWhy),
		noEffect("router-conditional-disagg-config", "DYN_ROUTER_CONDITIONAL_DISAGG_CONFIG", disaggWhy),
	}
	// Conditional disaggregation's policy settings, environment only in
	// Dynamo (its router reads them beside the JSON flag above).
	for _, e := range []string{"DYN_ROUTER_CONDITIONAL_DISAGG_POLICY", "DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD",
		"DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_RATIO_THRESHOLD", "DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD",
		"DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD"} {
		specs = append(specs, flagSpec{env: []string{e}, set: func(string) error {
			d.warnf(warn, "has no effect here: %s", disaggWhy)
			return nil
		}})
	}
	// The AIC/AISimulate prefill load model's inputs (--router-prefill-load-model
	// aic): --ais-* with the legacy --aic-* spelling, DYN_AIS_* (DYN_AIC_* in
	// Dynamo's earlier releases and its reference page).
	const aisWhy = "there is no AIC/AISimulate prefill load model (--router-prefill-load-model aic)"
	specs = append(specs, noEffect("ais-perf-config", "DYN_AIS_PERF_CONFIG", aisWhy))
	for _, f := range []string{"backend", "system", "backend-version", "tp-size", "model-path", "moe-tp-size",
		"moe-ep-size", "attention-dp-size", "nextn", "nextn-accept-rates", "mtp-seed"} {
		sp := noEffect("ais-"+f, "DYN_AIS_"+strings.ToUpper(strings.ReplaceAll(f, "-", "_")), aisWhy)
		sp.names = append(sp.names, "aic-"+f)
		if !strings.HasPrefix(f, "nextn") && f != "mtp-seed" {
			sp.env = append(sp.env, "DYN_AIC_"+strings.ToUpper(strings.ReplaceAll(f, "-", "_")))
		}
		specs = append(specs, sp)
	}
	specs = append(specs, pair("router-kv-events", []string{"DYN_ROUTER_USE_KV_EVENTS", "DYN_USE_KV_EVENTS", "DYN_KV_EVENTS"},
		"route by the workers' KV events (default; --no-router-kv-events: kv becomes kv-approx, predicting from its own decisions)",
		func(on bool) {
			d.noEvents = ""
			if !on {
				d.noEvents = d.src
			}
		}, "kv-events")...)
	specs = append(specs, pair("router-track-prefill-tokens", []string{"DYN_ROUTER_TRACK_PREFILL_TOKENS"},
		"count prompt tokens in the load (default true)", func(on bool) { c.Router.TrackPrefillTokens = on })...)
	specs = append(specs, pair("router-track-output-blocks", []string{"DYN_ROUTER_TRACK_OUTPUT_BLOCKS"},
		"grow a worker's active blocks as its requests stream: one block per block of output, decayed toward nvext.agent_hints.osl (default false)",
		func(on bool) { c.Router.TrackOutputBlocks = on }, "track-output-blocks")...)
	specs = append(specs, pair("router-assume-kv-reuse", []string{"DYN_ROUTER_ASSUME_KV_REUSE"},
		"requests sharing a prefix on a worker share its active blocks (default true; --no-router-assume-kv-reuse: every request's blocks count on their own)",
		func(on bool) { c.Router.DistinctActiveBlocks = !on }, "assume-kv-reuse")...)
	// Dynamo's default for replica sync is off; here it is always on.
	specs = append(specs, negatable("router-replica-sync", "DYN_ROUTER_REPLICA_SYNC", true,
		"replicas always share their bookings over NATS core (the load view of several replicas needs it)")...)
	specs = append(specs, negatable("router-durable-kv-events", "DYN_ROUTER_DURABLE_KV_EVENTS", true,
		"KV events are always durable here (JetStream, acknowledged after the Raft commit)", "durable-kv-events")...)
	specs = append(specs, negatable("router-track-active-blocks", "DYN_ROUTER_TRACK_ACTIVE_BLOCKS", true,
		"active blocks are always tracked: the cost function needs them", "track-active-blocks")...)
	specs = append(specs, negatable("router-reset-states", "DYN_ROUTER_RESET_STATES", false,
		"the index is replicated state: wiping it at one replica's start would wipe every replica's; deregister workers instead")...)
	specs = append(specs, negatable("use-remote-indexer", "DYN_USE_REMOTE_INDEXER", false,
		"every replica holds the whole index (replicated through Raft)")...)
	specs = append(specs, negatable("serve-indexer", "DYN_SERVE_INDEXER", false,
		"every replica holds the whole index (replicated through Raft); there is no remote-indexer protocol to serve")...)
	specs = append(specs, negatable("enable-session-prefix-index", "DYN_ENABLE_SESSION_PREFIX_INDEX", false,
		"there is no per-session prefix index (Dynamo's is experimental and no routing decision reads it yet)")...)
	specs = append(specs, negatable("router-conditional-prefill", "DYN_ROUTER_CONDITIONAL_PREFILL", false, disaggWhy)...)
	specs = append(specs, negatable("router-conditional-disagg", "DYN_ROUTER_CONDITIONAL_DISAGG", false, disaggWhy)...)
	specs = append(specs, negatable("enforce-disagg", "DYN_ENFORCE_DISAGG", false,
		"a request that cannot be disaggregated is served aggregated (Dynamo deprecated and ignores it too)")...)
	specs = append(specs, negatable("decode-fallback", "DYN_DECODE_FALLBACK", true,
		"a request that cannot be disaggregated is always served aggregated, counted in kvrouter_disagg_decisions_total{outcome=\"fallback\"}")...)
	return specs
}

// modeScoped are the knobs only some modes read. Given with any other mode
// they would silently do nothing: they warn, and the knob is put back to its
// default, so the routers run with what they would have run with without it
// (the configuration shows no value that does nothing).
var modeScoped = []struct {
	key   string // spec key (dynamoState.given)
	modes []router.Mode
	why   string
	reset func(r, def *router.Config)
}{
	{"router-temperature", costModes, "only the cost-function modes (kv, kv-approx, kv-pooled, load-aware) sample by temperature",
		func(r, def *router.Config) { r.Temperature = def.Temperature }},
	{"router-prefill-load-scale", costModes, "only the cost-function modes (kv, kv-approx, kv-pooled, load-aware) weigh prefill against decode",
		func(r, def *router.Config) { r.PrefillLoadScale = def.PrefillLoadScale }},
	{"router-kv-overlap-score-weight", costModes, "only the cost-function modes (kv, kv-approx, kv-pooled, load-aware) weigh prefill against decode",
		func(r, def *router.Config) {
			r.PrefillLoadScale, r.OverlapCredit = def.PrefillLoadScale, def.OverlapCredit
		}},
	{"router-decode-active-request-weight", costModes, "only the cost-function modes (kv, kv-approx, kv-pooled, load-aware) price requests in flight",
		func(r, def *router.Config) { r.DecodeActiveRequestWeight = def.DecodeActiveRequestWeight }},
	{"router-kv-overlap-score-credit", indexModes, "only kv, kv-approx and kv-pooled credit cached blocks",
		func(r, def *router.Config) { r.OverlapCredit = def.OverlapCredit }},
	{"router-kv-overlap-score-credit-decay", indexModes, "only kv, kv-approx and kv-pooled credit cached blocks",
		func(r, def *router.Config) { r.OverlapCreditDecay = def.OverlapCreditDecay }},
	{"router-host-cache-hit-weight", []router.Mode{router.ModeKV}, "only kv mode reads the workers' offload tiers",
		func(r, def *router.Config) { r.HostCacheHitWeight = def.HostCacheHitWeight }},
	{"router-disk-cache-hit-weight", []router.Mode{router.ModeKV}, "only kv mode reads the workers' offload tiers",
		func(r, def *router.Config) { r.DiskCacheHitWeight = def.DiskCacheHitWeight }},
	{"router-ttl-secs", []router.Mode{router.ModeKVApprox}, "only approximate mode (kv-approx: kv with --no-router-kv-events) predicts blocks, as in Dynamo",
		func(r, def *router.Config) { r.ApproxTTL = def.ApproxTTL }},
	{"pooled-wait-weight", []router.Mode{router.ModeKVPooled}, "only kv-pooled prices the wait over the admission line",
		func(r, def *router.Config) { r.Pooled.WaitWeight = def.Pooled.WaitWeight }},
}

var (
	costModes  = []router.Mode{router.ModeKV, router.ModeKVApprox, router.ModeKVPooled, router.ModeLoadAware}
	indexModes = []router.Mode{router.ModeKV, router.ModeKVApprox, router.ModeKVPooled}
)

// apply finishes what the Dynamo names leave to the end, once every flag
// and environment variable is read: the mode (Dynamo's load-aware preset
// over --router-mode, then the switch to approximate mode), a warning for
// each knob the final mode does not read, then the preset's values.
func (d *dynamoState) apply(c *serveConfig, warn func(string)) {
	r := &c.Router
	def := router.DefaultConfig()
	if d.loadAware != "" {
		// Dynamo's preset overrides these whatever else was given; what
		// it overrides does nothing, so it says so.
		r.Mode = router.ModeLoadAware
		if !r.TrackPrefillTokens {
			src := d.given["no-router-track-prefill-tokens"]
			for _, k := range []string{"router-track-prefill-tokens", "KVROUTER_NO_TRACK_PREFILL_TOKENS"} {
				if src == "" {
					src = d.given[k]
				}
			}
			warn(fmt.Sprintf("%s has no effect with %s: Dynamo's load-aware preset tracks prompt tokens", src, d.loadAware))
		}
		if src, ok := d.given["router-assume-kv-reuse"]; ok && !r.DistinctActiveBlocks {
			warn(fmt.Sprintf("%s has no effect with %s: Dynamo's load-aware preset assumes no KV reuse", src, d.loadAware))
		}
	}
	if d.noEvents != "" {
		switch r.Mode {
		case router.ModeKV:
			r.Mode = router.ModeKVApprox
		case router.ModeKVApprox, router.ModeLoadAware:
			// Already without events: kv-approx is kv without them, and
			// Dynamo's load-aware preset turns them off itself.
		case router.ModeKVPooled:
			warn(fmt.Sprintf("%s has no effect with --router-mode kv-pooled: kv-pooled places by the index the workers' KV events build and has no approximate variant, so it keeps routing by events; use --router-mode kv-approx to route without them", d.noEvents))
		default:
			warn(fmt.Sprintf("%s has no effect with --router-mode %s: it does not route by KV events anyway", d.noEvents, r.Mode))
		}
	}
	for _, k := range modeScoped {
		if src, ok := d.given[k.key]; ok && !slices.Contains(k.modes, r.Mode) {
			warn(fmt.Sprintf("%s has no effect with --router-mode %s: %s", src, r.Mode, k.why))
			k.reset(r, &def)
		}
	}
	if src, ok := d.given["router-queue-policy"]; ok && r.QueueThreshold == nil {
		warn(fmt.Sprintf("%s has no effect without --router-queue-threshold: no queue forms, as in Dynamo", src))
		r.QueuePolicy = def.QueuePolicy
	}
	if d.loadAware != "" {
		r.OverlapCredit, r.DistinctActiveBlocks, r.TrackPrefillTokens = 0, true, true
	}
}

// logStartupWarnings logs what parseServe found worth a warning (runServe).
func logStartupWarnings(log *slog.Logger, warnings []string) {
	for _, w := range warnings {
		log.Warn("startup warning: an option does not work as given", "detail", w)
	}
}

func names(n string) []string {
	if n == "" {
		return nil
	}
	return []string{n}
}

func envs(e string) []string {
	if e == "" {
		return nil
	}
	return []string{e}
}

// parseDynamoMode reads --router-mode, including Dynamo's modes we route
// differently.
func parseDynamoMode(v string, warn func(string), d *dynamoState) (router.Mode, error) {
	switch v {
	case "device-aware-weighted", "device_aware_weighted":
		// Workers carry no device type here, so every worker is of one
		// type, and Dynamo's weighting between types has nothing to weigh:
		// fewest requests in flight.
		return router.ModeLeastLoaded, nil
	case "direct":
		d.warnf(warn, "has no effect here: a client-chosen worker is not supported; routed by the cost function (kv)")
		return router.ModeKV, nil
	}
	return router.ParseMode(v)
}

// isNone is Dynamo's literal for "no threshold" on the command line.
func isNone(v string) bool { return strings.EqualFold(v, "none") }
