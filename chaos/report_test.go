package chaos

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// These tests need neither root nor the `chaos` tag: they pin the report
// contract (docs/CONTRACTS.md), the SCENARIOS/DURATION syntax, the HAProxy
// config derivation and the linearizability checker.

func TestChaosReportContractFields(t *testing.T) {
	r := Result{ID: "T1", Lost: 0, Duplicates: 0, FailoverP99: 2.5, Availability: 0.999, AvailabilityNoRetry: math.NaN()}
	r.Require("failover_p99_s", r.FailoverP99, "<=", 5, "")
	r.Finish()
	rep := &Report{RunID: "x", Scenarios: []Result{r}}
	path := filepath.Join(t.TempDir(), "out", "report.json")
	if err := rep.Write(path); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		Scenarios []map[string]any `json:"scenarios"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatalf("report is not JSON: %v\n%s", err, data)
	}
	if len(raw.Scenarios) != 1 {
		t.Fatalf("scenarios: %v", raw.Scenarios)
	}
	sc := raw.Scenarios[0]
	for _, k := range []string{"id", "passed", "lost", "duplicates", "failover_p99_s", "availability"} {
		if _, ok := sc[k]; !ok {
			t.Errorf("contract field %q missing: %v", k, sc)
		}
	}
	if sc["id"] != "T1" || sc["passed"] != true || sc["lost"] != 0.0 || sc["failover_p99_s"] != 2.5 {
		t.Errorf("values: %v", sc)
	}
	if sc["availability_no_retry"] != -1.0 {
		t.Errorf("NaN must be written as -1, got %v", sc["availability_no_retry"])
	}
	back, err := ReadReport(path)
	if err != nil || !back.Passed || back.Scenarios[0].ID != "T1" {
		t.Fatalf("read back: %+v, %v", back, err)
	}
	if _, err := os.Stat(path + ".tmp"); !os.IsNotExist(err) {
		t.Errorf("temp file left behind")
	}
}

func TestChaosResultChecks(t *testing.T) {
	var r Result
	r.Require("a", 1, "<=", 5, "")
	r.Require("b", 0.99, ">=", 0.995, "with retry")
	r.Require("c", math.NaN(), "<=", 3, "")
	r.RequireTrue("d", true, "")
	r.Finish()
	if r.Passed {
		t.Fatal("failed checks must fail the result")
	}
	if len(r.Failures) != 2 || !strings.Contains(r.Failures[0], "b: 0.99, want >= 0.995 (with retry)") || !strings.Contains(r.Failures[1], "not measured") {
		t.Fatalf("failures: %q", r.Failures)
	}
	var ok Result
	ok.Require("a", 0, "==", 0, "")
	ok.Finish()
	if !ok.Passed {
		t.Fatal("all checks hold: passed")
	}
	var none Result
	none.Finish()
	if none.Passed {
		t.Fatal("no checks at all must not pass")
	}
	bad := Result{Error: "setup: boom"}
	bad.Require("a", 0, "==", 0, "")
	bad.Finish()
	if bad.Passed {
		t.Fatal("an error fails the result")
	}
}

func TestChaosParseScenarios(t *testing.T) {
	cases := []struct {
		in   string
		want []string
		err  bool
	}{
		{"", []string{"T1", "T4", "T6"}, false},
		{"T1,T4,T6", []string{"T1", "T4", "T6"}, false},
		{" t4 , T1,t4", []string{"T4", "T1"}, false},
		{"all", []string{"T1", "T2", "T3", "T4", "T5", "T6", "T7", "T8", "T11", "G1", "D1", "D2", "A1", "AF1", "U1"}, false},
		{"d1", []string{"D1"}, false},
		{"S1", []string{"S1"}, false},
		{"a1", []string{"A1"}, false},
		{"g1", []string{"G1"}, false},
		{"T9", nil, true},
		{",", nil, true},
	}
	for _, c := range cases {
		got, err := ParseScenarios(c.in)
		if (err != nil) != c.err || !slices.Equal(got, c.want) {
			t.Errorf("ParseScenarios(%q) = %v, %v; want %v (error %v)", c.in, got, err, c.want, c.err)
		}
	}
	short, err := ParseScenarios("short")
	// CI runs the short tier (.ci/chaos-tier): the security probes and G1
	// (the sharded index; ~56 s at 45 s of faults, inside the tier's 90 s
	// per scenario) are in it, and D1 (a drain racing a failover, issue
	// 29; its fault phase is cut to 30 s); the checker's self-test and the
	// upgrade (which needs a second build) are not.
	if err != nil || len(short) == 0 || slices.Contains(short, "S1") || slices.Contains(short, "U1") || !slices.Contains(short, "A1") ||
		!slices.Contains(short, "G1") || !slices.Contains(short, "D1") {
		t.Errorf("short tier: %v, %v", short, err)
	}
}

func TestChaosParseDuration(t *testing.T) {
	cases := []struct {
		in   string
		want time.Duration
		err  bool
	}{
		{"", 60 * time.Second, false},
		{"60s", 60 * time.Second, false},
		{"2m", 2 * time.Minute, false},
		{"90", 90 * time.Second, false},
		{"10s", 0, true},
		{"soon", 0, true},
		{"NaN", 0, true},
	}
	for _, c := range cases {
		got, err := ParseDuration(c.in)
		if (err != nil) != c.err || (!c.err && got != c.want) {
			t.Errorf("ParseDuration(%q) = %v, %v; want %v (error %v)", c.in, got, err, c.want, c.err)
		}
	}
}

func TestChaosPercentile(t *testing.T) {
	if !math.IsNaN(Percentile(nil, 99)) {
		t.Error("no samples: NaN")
	}
	xs := []float64{3, 1, 2}
	if Percentile(xs, 99) != 3 || Percentile(xs, 50) != 2 || Percentile(xs, 1) != 1 {
		t.Errorf("percentiles of %v", xs)
	}
	if !slices.Equal(xs, []float64{3, 1, 2}) {
		t.Error("input reordered")
	}
	var hundred []float64
	for i := 1; i <= 200; i++ {
		hundred = append(hundred, float64(i))
	}
	if got := Percentile(hundred, 99); got != 198 {
		t.Errorf("p99 of 1..200 = %v", got)
	}
	if !math.IsNaN(Ratio(1, 0)) || Ratio(1, 4) != 0.25 {
		t.Error("Ratio")
	}
}

// The harness derives its HAProxy config from the deployed one; if the
// deployed file changes shape, this fails here rather than in a root-only
// chaos run.
func TestChaosHAProxyConfigFromDeploy(t *testing.T) {
	cfg, err := haproxyConfig(filepath.Join("..", "deploy", "haproxy", "haproxy.cfg"), []int{1, 2, 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"bind 10.77.0.1:8000", "bind 10.77.0.1:8404",
		"server r1 10.77.0.11:8080 check", "server r2 10.77.0.12:8080 check", "server r3 10.77.0.13:8080 check",
		"option httpchk GET /ready",
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("derived config lacks %q", want)
		}
	}
	// Every backend with servers in the deployed file (replicas, survivors)
	// has all three members in the derived one.
	tmpl, err := os.ReadFile(filepath.Join("..", "deploy", "haproxy", "haproxy.cfg"))
	if err != nil {
		t.Fatal(err)
	}
	backends := 0
	for _, sec := range strings.Split(string(tmpl), "\nbackend ")[1:] {
		if strings.Contains(sec, "\n    server r") {
			backends++
		}
	}
	for _, want := range []string{"server r1 10.77.0.11:8080 check", "server r2 10.77.0.12:8080 check", "server r3 10.77.0.13:8080 check"} {
		if n := strings.Count(cfg, want); n != backends || backends == 0 {
			t.Errorf("%q in %d backends, the deployed file has %d backends with servers", want, n, backends)
		}
	}
	for _, line := range strings.Split(cfg, "\n") {
		if l := strings.TrimSpace(line); !strings.HasPrefix(l, "#") && (strings.Contains(l, "127.0.0.1:800") || strings.Contains(l, "bind :8000")) {
			t.Errorf("derived config still has a local address: %q", l)
		}
	}
	if _, err := haproxyConfig(filepath.Join(t.TempDir(), "missing.cfg"), []int{1}, nil); err == nil {
		t.Error("missing template: error")
	}
	bad := filepath.Join(t.TempDir(), "bad.cfg")
	_ = os.WriteFile(bad, []byte("global\n"), 0o644)
	if _, err := haproxyConfig(bad, []int{1}, nil); err == nil {
		t.Error("template without bind/server lines: error")
	}
}

// With TLS the checks get the harness's TLS options, per server, and the
// TLS options a deployed file carries for its own setting (its CA path,
// its SNI) are gone from server and default-server lines, whether the
// deployed checks are plain or not.
func TestChaosHAProxyConfigTLSChecks(t *testing.T) {
	checkTLS := func(i int) string {
		return fmt.Sprintf("check-ssl verify required ca-file /run/ca.pem verifyhost r%d.kvc", i)
	}
	deployed := filepath.Join("..", "deploy", "haproxy", "haproxy.cfg")
	tlsTemplate := filepath.Join(t.TempDir(), "tls.cfg")
	if err := os.WriteFile(tlsTemplate, []byte(`defaults
    mode tcp
frontend kvrouter
    bind :8000
backend replicas
    option httpchk GET /ready
    default-server inter 500ms check-ssl verify required ca-file /certs/ca.pem fall 2
    server r1 r1:8080 check check-ssl verify required ca-file /certs/ca.pem check-sni r1 inter 1s
    server r2 r2:8080 check check-ssl verify required ca-file /certs/ca.pem check-sni r2 inter 1s
`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tmpl := range []string{deployed, tlsTemplate} {
		cfg, err := haproxyConfig(tmpl, []int{1, 2, 3}, checkTLS)
		if err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= 3; i++ {
			want := fmt.Sprintf("check-ssl verify required ca-file /run/ca.pem verifyhost r%d.kvc", i)
			for _, line := range strings.Split(cfg, "\n") {
				if strings.Contains(line, fmt.Sprintf("server r%d ", i)) && !strings.HasSuffix(line, want) {
					t.Errorf("%s: %q does not end with %q", tmpl, line, want)
				}
			}
		}
		for _, gone := range []string{"/certs/ca.pem", "check-sni", "ca-file /run/ca.pem verifyhost r1.kvc check-ssl"} {
			if strings.Contains(cfg, gone) {
				t.Errorf("%s: derived config still has %q:\n%s", tmpl, gone, cfg)
			}
		}
		if tmpl == tlsTemplate {
			for _, want := range []string{"    default-server inter 500ms fall 2", "server r1 10.77.0.11:8080 check inter 1s check-ssl"} {
				if !strings.Contains(cfg, want) {
					t.Errorf("derived config lacks %q:\n%s", want, cfg)
				}
			}
		}
	}
}

func TestChaosLinearizabilityChecker(t *testing.T) {
	ms := func(n int64) int64 { return n * int64(time.Millisecond) }
	h := &adminHistory{}
	// write(1) [0,10]; read → 1 [20,30] on another replica: fine.
	h.add(adminOp{Client: 0, Replica: "r1", Write: true, Value: 1, Call: ms(0), Return: ms(10), OK: true})
	h.add(adminOp{Client: 1, Replica: "r2", Value: 1, Call: ms(20), Return: ms(30), OK: true})
	// A failed write has an unknown outcome: a later read may see it.
	h.add(adminOp{Client: 0, Replica: "r1", Write: true, Value: 2, Call: ms(40), Return: ms(50), Err: "HTTP 503"})
	h.add(adminOp{Client: 1, Replica: "r2", Value: 2, Call: ms(60), Return: ms(70), OK: true})
	// Failed reads are ignored.
	h.add(adminOp{Client: 2, Replica: "r3", Value: 0, Call: ms(60), Return: ms(70), Err: "timeout"})
	res := checkLinearizable(h, 10*time.Second, "")
	if res.Result != "Ok" || res.Reads != 2 || res.Writes != 1 || res.Unknown != 1 || res.FailedReads != 1 {
		t.Fatalf("linearizable history: %+v", res)
	}
	// A stale read: write(3) completed, then a read still returns 1.
	h.add(adminOp{Client: 0, Replica: "r1", Write: true, Value: 3, Call: ms(80), Return: ms(90), OK: true})
	h.add(adminOp{Client: 2, Replica: "r3", Value: 1, Call: ms(100), Return: ms(110), OK: true})
	vis := filepath.Join(t.TempDir(), "vis.html")
	res = checkLinearizable(h, 10*time.Second, vis)
	if res.Result != "Illegal" {
		t.Fatalf("stale read must be Illegal: %+v", res)
	}
	if res.StaleReads == nil || res.StaleReads.Count != 1 || res.StaleReads.ByReplica["r3"] != 1 || res.StaleReads.MaxLagMs != 10 ||
		!strings.Contains(res.StaleReads.Examples[0], "read 1 from r3") {
		t.Errorf("stale read evidence: %+v", res.StaleReads)
	}
	if _, err := os.Stat(vis); err != nil || res.Visual != vis {
		t.Errorf("visualization not written: %v %q", err, res.Visual)
	}
	// Failed writes the API says were not applied are left out; if one
	// was applied after all, reading its value is Illegal.
	h3 := &adminHistory{}
	h3.add(adminOp{Client: 0, Replica: "r1", Write: true, Value: 5, Call: ms(0), Return: ms(1), Err: `HTTP 503: {"error":"cluster unavailable: cluster: no leader: none known to r1"}`})
	h3.add(adminOp{Client: 0, Replica: "r2", Write: true, Value: 6, Call: ms(2), Return: ms(3), Err: "dial tcp 10.77.0.12:8080: connect: connection refused"})
	h3.add(adminOp{Client: 1, Replica: "r3", Value: -1, Call: ms(5), Return: ms(6), OK: true})
	if r := checkLinearizable(h3, time.Second, ""); r.Result != "Ok" || r.NotApplied != 2 || r.Unknown != 0 {
		t.Errorf("not-applied writes: %+v", r)
	}
	h3.add(adminOp{Client: 1, Replica: "r3", Value: 5, Call: ms(7), Return: ms(8), OK: true})
	if r := checkLinearizable(h3, time.Second, ""); r.Result != "Illegal" || len(r.ReadsOfRefused) != 1 {
		t.Errorf("a 'no leader' write that took effect must be Illegal and named: %+v", r)
	}
	for err, want := range map[string]bool{
		`HTTP 503: {"error":"cluster unavailable: apply: cluster: outcome unknown, the entry may still commit"}`: false,
		`HTTP 503: {"error":"cluster unavailable: cluster: no leader: leader r1 unreachable"}`:                   true,
		`HTTP 400: {"error":"bad threshold"}`:                       true,
		`Post "http://x/busy_threshold": context deadline exceeded`: false,
		`Post "http://x/busy_threshold": EOF`:                       false,
	} {
		if notApplied(err) != want {
			t.Errorf("notApplied(%q) = %v", err, !want)
		}
	}

	h4 := &adminHistory{}
	h4.add(adminOp{Client: 0, Replica: "r1", Value: 77, Call: 0, Return: 1, OK: true})
	if r := checkLinearizable(h4, time.Second, ""); r.Result != "Illegal" || len(r.ReadsOfUnwritten) != 1 {
		t.Errorf("a value nobody wrote: %+v", r)
	}

	// The initial value is null (-1).
	h2 := &adminHistory{}
	h2.add(adminOp{Client: 0, Replica: "r1", Value: -1, Call: 0, Return: 1, OK: true})
	if r := checkLinearizable(h2, time.Second, ""); r.Result != "Ok" {
		t.Errorf("initial null read: %+v", r)
	}
}
