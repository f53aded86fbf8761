// Package disaggflag parses the disaggregated prefill/decode settings for
// both binaries that take them: `kvrouter serve --disagg-*` routes with
// them, `kvbench disagg` simulates them. One parser means a setting copied
// from a replica's command line means the same thing in the simulator.
//
// The package knows nothing of either binary's flag machinery (kvrouter's
// flags also read environment variables; kvbench's are a flag.FlagSet):
// it describes each setting as a Flag, and each binary registers the
// Flags it takes in its own way. kvbench registers them under its older,
// shorter names too (--kv-shape for --disagg-model-shape, …), so every
// spelling either binary ever accepted keeps working.
package disaggflag

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// Flag is one setting on the command line.
type Flag struct {
	Names   []string // the first is the canonical name; the rest aliases
	Env     []string // environment variables kvrouter reads when the flag is absent
	Default string   // applied with Set before the command line; "" = none
	Usage   string
	Bool    bool // a switch: "--name" alone means true
	Set     func(string) error
}

// Settings are kvrouter serve's disaggregation settings. The planner needs
// three things the router does not observe: the model's KV bytes per
// token, the transfer link, and the workers' step times (an engine
// profile, as the simulator uses).
type Settings struct {
	Mode        router.DisaggMode
	KV          router.ModelKV
	LinkMBps    float64 // MB/s (1e6 bytes) shared by concurrent transfers
	LinkPerPair bool    // each prefill/decode pair has its own link of that speed
	LinkMax     int     // transfers at once on the link (0 = no limit)
	LinkLatency time.Duration
	Profile     string  // engine profile of the workers' step times
	Speedup     float64 // divides the profile's step times (kvmock --speedup)
	Retries     int     // failed transfers restarted before serving aggregated
}

// Flags are every setting, in kvrouter serve's order and with its defaults.
func (s *Settings) Flags() []Flag {
	return []Flag{
		Mode(&s.Mode),
		KVBytesPerToken(&s.KV),
		ModelShape(&s.KV),
		LinkMBps(&s.LinkMBps),
		LinkPerPair(&s.LinkPerPair),
		LinkMaxTransfers(&s.LinkMax),
		LinkLatency(&s.LinkLatency),
		Profile(&s.Profile),
		Speedup(&s.Speedup),
		TransferRetries(&s.Retries),
	}
}

// Mode is --disagg.
func Mode(m *router.DisaggMode) Flag {
	return Flag{Names: []string{"disagg"}, Env: []string{"KVROUTER_DISAGG"}, Default: "off",
		Usage: "disaggregated prefill/decode: off (aggregated on decode-capable workers), always (while a prefill worker is healthy), auto (per request, the lower estimated TTFT)",
		Set: func(v string) error {
			mode, err := router.ParseDisaggMode(v)
			*m = mode
			return err
		}}
}

// KVBytesPerToken is --disagg-kv-bytes-per-token. A positive value wins
// over the model shape whatever the order on the command line (it is
// router.ModelKV's Given); 0 leaves the shape in charge.
func KVBytesPerToken(kv *router.ModelKV) Flag {
	return Flag{Names: []string{"disagg-kv-bytes-per-token"}, Env: []string{"KVROUTER_DISAGG_KV_BYTES_PER_TOKEN"},
		Usage: "KV cache bytes per token as measured or known (overrides the model shape)",
		Set: func(v string) error {
			var n int64
			if _, err := fmt.Sscan(v, &n); err != nil || n < 0 {
				return fmt.Errorf("bytes per token %q: want a non-negative integer", v)
			}
			kv.Given = n
			return nil
		}}
}

// ModelShape is --disagg-model-shape.
func ModelShape(kv *router.ModelKV) Flag {
	return Flag{Names: []string{"disagg-model-shape"}, Env: []string{"KVROUTER_DISAGG_MODEL_SHAPE"}, Default: "28,8,128,2",
		Usage: "layers,kv-heads,head-dim,dtype-bytes of the model (KV bytes per token = product × 2); default Qwen3-0.6B = 114,688 B",
		Set: func(v string) error {
			var l, h, d, b int
			if n, err := fmt.Sscanf(strings.ReplaceAll(v, " ", ""), "%d,%d,%d,%d", &l, &h, &d, &b); err != nil || n != 4 {
				return fmt.Errorf("model shape %q: want layers,kv-heads,head-dim,dtype-bytes", v)
			}
			kv.Layers, kv.KVHeads, kv.HeadDim, kv.DTypeBytes = l, h, d, b
			return nil
		}}
}

// LinkMBps is --disagg-link-mbps.
func LinkMBps(f *float64) Flag {
	return Flag{Names: []string{"disagg-link-mbps"}, Env: []string{"KVROUTER_DISAGG_LINK_MBPS"}, Default: "104",
		Usage: "prefill→decode KV transfer throughput in MB/s, shared fairly by concurrent transfers (seed 001: 104 on 1 GbE)",
		Set:   floatp(f)}
}

// LinkPerPair is --disagg-link-per-pair.
func LinkPerPair(b *bool) Flag {
	return Flag{Names: []string{"disagg-link-per-pair"}, Env: []string{"KVROUTER_DISAGG_LINK_PER_PAIR"}, Bool: true,
		Usage: "every prefill/decode pair has its own link of that speed (default: one shared link)",
		Set: func(v string) error {
			x, err := strconv.ParseBool(v)
			*b = x
			return err
		}}
}

// LinkMaxTransfers is --disagg-link-max-transfers.
func LinkMaxTransfers(n *int) Flag {
	return Flag{Names: []string{"disagg-link-max-transfers"}, Env: []string{"KVROUTER_DISAGG_LINK_MAX_TRANSFERS"}, Default: "0",
		Usage: "transfers moving at once on a link (0 = no limit; later ones queue)",
		Set:   intp(n)}
}

// LinkLatency is --disagg-link-latency.
func LinkLatency(d *time.Duration) Flag {
	return Flag{Names: []string{"disagg-link-latency"}, Env: []string{"KVROUTER_DISAGG_LINK_LATENCY"}, Default: "0s",
		Usage: "fixed cost per transfer before bytes flow",
		Set: func(v string) error {
			x, err := time.ParseDuration(v)
			*d = x
			return err
		}}
}

// Profile is --disagg-profile.
func Profile(p *string) Flag {
	return Flag{Names: []string{"disagg-profile"}, Env: []string{"KVROUTER_DISAGG_PROFILE"}, Default: engine.ProfileDynamoMocker,
		Usage: "engine step-time profile the TTFT estimates use: " + strings.Join(engine.Profiles(), ", "),
		Set:   func(v string) error { *p = v; return nil }}
}

// Speedup is --disagg-speedup.
func Speedup(f *float64) Flag {
	return Flag{Names: []string{"disagg-speedup"}, Env: []string{"KVROUTER_DISAGG_SPEEDUP"}, Default: "1",
		Usage: "divides the profile's step times (match the workers' kvmock --speedup)",
		Set:   floatp(f)}
}

// TransferRetries is --disagg-transfer-retries.
func TransferRetries(n *int) Flag {
	return Flag{Names: []string{"disagg-transfer-retries"}, Env: []string{"KVROUTER_DISAGG_TRANSFER_RETRIES"}, Default: "1",
		Usage: "failed KV transfers restarted before the request is served aggregated on its decode worker",
		Set:   intp(n)}
}

// Register defines f on fs under all its names, after applying its
// default: usage on the first name, "alias of --first" on the others.
// Environment variables are kvrouter's business and ignored here.
func (f Flag) Register(fs *flag.FlagSet) error {
	if f.Default != "" {
		if err := f.Set(f.Default); err != nil {
			return fmt.Errorf("default of --%s: %w", f.Names[0], err)
		}
	}
	for i, n := range f.Names {
		u := f.Usage
		if f.Default != "" {
			u += " (default " + f.Default + ")"
		}
		if i > 0 {
			u = "alias of --" + f.Names[0]
		}
		if f.Bool {
			fs.BoolFunc(n, u, f.Set)
		} else {
			fs.Func(n, u, f.Set)
		}
	}
	return nil
}

// RouterConfig turns the settings into the router's configuration; errors
// name the flag.
func (s Settings) RouterConfig() (router.DisaggConfig, error) {
	prof, err := engine.LookupProfile(s.Profile)
	if err != nil {
		return router.DisaggConfig{}, fmt.Errorf("--disagg-profile: %w", err)
	}
	if s.Speedup <= 0 {
		return router.DisaggConfig{}, fmt.Errorf("--disagg-speedup %v must be positive", s.Speedup)
	}
	sp := s.Speedup
	link := router.Link{ThroughputBytesPerS: s.LinkMBps * 1e6 * sp, MaxConcurrent: s.LinkMax, Latency: time.Duration(float64(s.LinkLatency) / sp), PerPair: s.LinkPerPair}
	dc := router.DisaggConfig{
		Mode: s.Mode, KV: s.KV, TransferRetries: s.Retries,
		Timing: router.StepTiming{
			PrefillMs: func(n int) float64 { return prof.PrefillMs(n) / sp },
			DecodeMs:  func(f float64) float64 { return prof.DecodeMs(f) / sp },
			StepMs:    func(p, d int, f float64) float64 { return prof.StepMs(p, d, f) / sp },
		},
		Topology: router.SingleLink("link", link),
	}
	if err := dc.Validate(); err != nil {
		return router.DisaggConfig{}, fmt.Errorf("--disagg settings: %w", err)
	}
	return dc, nil
}

func intp(p *int) func(string) error {
	return func(v string) error {
		n, err := strconv.Atoi(v)
		*p = n
		return err
	}
}

func floatp(p *float64) func(string) error {
	return func(v string) error {
		f, err := strconv.ParseFloat(v, 64)
		*p = f
		return err
	}
}
