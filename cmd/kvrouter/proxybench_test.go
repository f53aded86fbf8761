package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/internal/proccpu"
)

// BenchmarkServeProxyOverhead is the replica-server benchmark, direct vs
// through a replica (issue 31 item 4): one replica started as run.sh starts
// it (TLS material, admin token, worker API key; plaintext on loopback), one
// in-process worker that answers a streamed completion the way kvmock does
// (headers flushed at once, the first token's chunk flushed on its own, the
// rest, usage, [DONE]), and kvbench's default prompt shape: a 2,032-token
// shared prefix and a 339-token fresh tail of builtin-tokenizer words sent
// as text to /v1/completions with stream and include_usage. Every
// request's tail is new, as kvbench load's are, so a cache of whole
// prompts finds only the shared prefix.
//
// Each sub-benchmark sends the same requests one at a time on one
// keep-alive connection: straight to the worker ("direct"), or through the
// replica over plaintext or HTTPS ("replica-http", "replica-https"). ns/op
// is the whole request; ttft-µs (the median time to the first "data:"
// line, as kvbench load measures TTFT) is the figure the proxy's added
// latency is read from: replica − direct.
func BenchmarkServeProxyOverhead(b *testing.B) {
	env := startProxyBench(b, false)
	// TLS on both legs (issue 31 item 4): the replica reaches an https://
	// worker whose certificate it checks with --worker-tls-ca.
	tlsEnv := startProxyBench(b, true)
	for _, tc := range []struct {
		name string
		base string
		hc   *http.Client
		key  string
	}{
		{"direct", env.worker, env.workerClient, proxyBenchWorkerKey},
		{"replica-http", env.plain, env.plainClient, ""},
		{"replica-https", env.https, env.tlsClient, ""},
		{"direct-https", tlsEnv.worker, tlsEnv.workerClient, proxyBenchWorkerKey},
		{"replica-https-worker-https", tlsEnv.https, tlsEnv.tlsClient, ""},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ttfts := make([]time.Duration, 0, b.N)
			cpu0 := proccpu.Self()
			for b.Loop() {
				ttfts = append(ttfts, env.complete(b, tc.hc, tc.base, tc.key))
			}
			cpu := proccpu.Self() - cpu0
			slices.Sort(ttfts)
			b.ReportMetric(float64(ttfts[len(ttfts)/2].Nanoseconds())/1e3, "ttft-µs")
			// The process's CPU (user + system) per request: client,
			// worker and replica together, so replica − direct is the
			// replica's own CPU per request, a figure far steadier on a
			// shared host than the latency, which waits for CPUs.
			b.ReportMetric(float64(cpu.Nanoseconds())/1e3/float64(b.N), "cpu-µs/op")
		})
	}
}

// TestServeWorkerTLSCA: with --worker-tls-ca, a replica routes to an
// https:// worker whose certificate chains to that CA (the proxy, as the
// benchmark above drives it).
func TestServeWorkerTLSCA(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica with TLS")
	}
	env := startProxyBench(t, true)
	if ttft := env.complete(t, env.tlsClient, env.https, ""); ttft <= 0 {
		t.Fatalf("no first token through the replica to an https worker")
	}
}

const (
	proxyBenchAdminToken = "bench-admin-token"
	proxyBenchWorkerKey  = "bench-worker-key"
	proxyBenchPrefix     = 2032 // kvbench's default prompt: shared prefix and fresh tail, in tokens
	proxyBenchTail       = 339
)

type proxyBench struct {
	plain, https, worker                 string
	plainClient, tlsClient, workerClient *http.Client
	prefix                               string // the shared prefix's text
	sent                                 uint64 // requests built: the next one's tail
	tok                                  tokenize.Tokenizer
}

// complete sends the next request (a new tail) and reads the stream to
// its end, as kvbench load does; it returns the time to the first data
// line.
func (env *proxyBench) complete(b testing.TB, hc *http.Client, base, key string) time.Duration {
	req, err := http.NewRequest(http.MethodPost, base+"/v1/completions", bytes.NewReader(env.body()))
	if err != nil {
		b.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	start := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		b.Fatalf("%s: HTTP %d: %s", base, resp.StatusCode, msg)
	}
	br := bufio.NewReader(resp.Body)
	var ttft time.Duration
	for {
		line, err := br.ReadString('\n')
		if ttft == 0 && strings.HasPrefix(line, "data:") {
			ttft = time.Since(start)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	if ttft == 0 {
		b.Fatalf("%s: no data line", base)
	}
	return ttft
}

// startProxyBench starts the worker (over HTTPS when workerTLS, its
// certificate given to the replica as --worker-tls-ca) and the replica,
// and waits until the replica routes to the worker.
func startProxyBench(b testing.TB, workerTLS bool) *proxyBench {
	b.Helper()
	dir := b.TempDir()
	l := pki.Layout{Dir: filepath.Join(dir, "certs")}
	if _, err := l.Ensure([]pki.Holder{{Identity: pki.Node("r1"), Hosts: []string{"127.0.0.1"}}}); err != nil {
		b.Fatal(err)
	}
	mat := l.Material(pki.Node("r1"))
	secret := func(name, v string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(v+"\n"), 0o600); err != nil {
			b.Fatal(err)
		}
		return p
	}
	worker := httptest.NewUnstartedServer(http.HandlerFunc(proxyBenchWorker))
	var workerCA []string
	if workerTLS {
		worker.StartTLS()
		ca := filepath.Join(dir, "worker-ca.pem")
		if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: worker.Certificate().Raw}), 0o600); err != nil {
			b.Fatal(err)
		}
		workerCA = []string{"--worker-tls-ca", ca}
	} else {
		worker.Start()
	}
	b.Cleanup(worker.Close)
	workerClient := worker.Client()
	workerClient.Transport.(*http.Transport).DisableCompression = true

	var ports []int
	var held []net.Listener
	for range 4 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		held = append(held, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	for _, ln := range held {
		ln.Close()
	}
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	args := []string{"--single-node", "--node-id", "r1", "--model", "m", "--data-dir", filepath.Join(dir, "r1"),
		"--http-addr", addr, "--raft-addr", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--nats-addr", fmt.Sprintf("127.0.0.1:%d", ports[2]), "--nats-cluster-addr", fmt.Sprintf("127.0.0.1:%d", ports[3]),
		"--tls-ca", mat.CAFile, "--tls-cert", mat.CertFile, "--tls-key", mat.KeyFile,
		"--admin-token-file", secret("admin-token", proxyBenchAdminToken),
		"--worker-api-key-file", secret("worker-api-key", proxyBenchWorkerKey),
		"--admin-open-to-loopback", "/busy_threshold"}
	args = append(args, workerCA...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	go func() { done <- runServe(ctx, args, nil, io.Discard) }()
	b.Cleanup(func() { cancel(); <-done })

	pool, err := pki.LoadPool(mat.CAFile)
	if err != nil {
		b.Fatal(err)
	}
	env := &proxyBench{
		plain: "http://" + addr, https: "https://" + addr, worker: worker.URL,
		plainClient: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}},
		tlsClient: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true,
			TLSClientConfig: pki.TrustOnlyTLS(pool, pki.AllowRoles(pki.RoleNode))}},
		workerClient: workerClient,
		prefix:       proxyBenchPrefixText(),
		tok:          tokenize.Builtin(),
	}
	reg := fmt.Sprintf(`{"id":"w1","url":%q,"model":"m","block_size":16,"total_kv_blocks":100000}`, worker.URL)
	poll.Until(b, 60*time.Second, 50*time.Millisecond, func() error {
		req, _ := http.NewRequest(http.MethodPost, env.plain+"/workers/register", strings.NewReader(reg))
		req.Header.Set("Authorization", "Bearer "+proxyBenchAdminToken)
		resp, err := env.plainClient.Do(req)
		if err != nil {
			return err
		}
		msg, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("register: HTTP %d: %s", resp.StatusCode, msg)
		}
		req, _ = http.NewRequest(http.MethodPost, env.plain+"/v1/completions", bytes.NewReader(env.body()))
		resp, err = env.plainClient.Do(req)
		if err != nil {
			return err
		}
		msg, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("completion: HTTP %d: %s", resp.StatusCode, msg)
		}
		return nil
	})
	return env
}

// proxyBenchWord draws a builtin-tokenizer word (one token each), as
// kvbench load's prompts are made of.
func proxyBenchWord(rng *rand.Rand) uint32 {
	return 384 + uint32(rng.IntN(tokenize.BuiltinVocabSize-384))
}

// proxyBenchPrefixText is the shared prefix of kvbench load's default
// requests, as text.
func proxyBenchPrefixText() string {
	rng := rand.New(rand.NewPCG(31, 4))
	prefix := make([]uint32, proxyBenchPrefix)
	for i := range prefix {
		prefix[i] = proxyBenchWord(rng)
	}
	return tokenize.Builtin().Decode(prefix)
}

// body is the next request: the shared prefix and a tail no request had
// before (Decode puts a space between words, so prefix + " " + tail is the
// text of their ids together).
func (env *proxyBench) body() []byte {
	env.sent++
	rng := rand.New(rand.NewPCG(env.sent, 5))
	tail := make([]uint32, proxyBenchTail)
	for i := range tail {
		tail[i] = proxyBenchWord(rng)
	}
	body, err := json.Marshal(map[string]any{"model": "m", "prompt": env.prefix + " " + env.tok.Decode(tail),
		"max_tokens": 4, "stream": true, "stream_options": map[string]bool{"include_usage": true}})
	if err != nil {
		panic(err)
	}
	return body
}

// proxyBenchWorker answers a streamed completion as kvmock does: it reads
// and parses the request, sends the event-stream headers at once, the first
// token's chunk flushed on its own, then the rest, a usage chunk and
// [DONE]. It takes no time to "generate": what is measured is transport.
func proxyBenchWorker(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Authorization") != "Bearer "+proxyBenchWorkerKey {
		http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
		return
	}
	var req struct {
		Prompt string `json:"prompt"`
		Stream bool   `json:"stream"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || !req.Stream {
		http.Error(w, "want a streamed completion", http.StatusBadRequest)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	f := w.(http.Flusher)
	f.Flush()
	const chunk = `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" w%d","finish_reason":null}]}` + "\n\n"
	fmt.Fprintf(w, chunk, 0)
	f.Flush()
	for i := 1; i < 4; i++ {
		fmt.Fprintf(w, chunk, i)
	}
	fmt.Fprint(w, `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":2371,"completion_tokens":4,"total_tokens":2375,"prompt_tokens_details":{"cached_tokens":2032}}}`+"\n\ndata: [DONE]\n\n")
	f.Flush()
}
