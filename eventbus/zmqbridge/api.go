package zmqbridge

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/internal/netaddr"
)

// Handler serves the bridge's HTTP API:
//
//	GET  /status               every worker's state and counters (JSON)
//	GET  /healthz              200 while the bridge runs
//	GET  /metrics              Prometheus metrics of gatherer
//	POST /workers/register     WorkerSpec JSON: start following a worker
//	POST /workers/deregister   {"id": ...}: stop following it and deregister it
//
// token, when set, is the bearer token the POST endpoints require. Without
// one they answer only clients on loopback (403 to anyone else) unless
// Config.InsecureAPI says otherwise: registering a worker points the
// bridge's sockets and HTTP probes at any address the caller names, and
// hands the cluster that worker, so an open endpoint on the network is a
// way in. CheckAPIListen refuses such a setup before it starts; this is
// the same rule at request time, for whoever builds the server without it.
func (b *Bridge) Handler(gatherer prometheus.Gatherer, token string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"block_size": b.cfg.BlockSize, "workers": b.Status()})
	})
	if gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	auth := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			switch {
			case token != "":
				got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
				if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
					writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "bearer token required"})
					return
				}
			case !b.cfg.InsecureAPI && !loopbackRemote(r.RemoteAddr):
				writeJSON(w, http.StatusForbidden, map[string]string{
					"error": "the bridge has no API token: /workers/* answers only loopback clients (give the bridge an API token)"})
				return
			}
			h(w, r)
		}
	}
	mux.HandleFunc("POST /workers/register", auth(func(w http.ResponseWriter, r *http.Request) {
		var spec WorkerSpec
		dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&spec); err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "invalid JSON body: " + err.Error()})
			return
		}
		if err := b.Add(spec); err != nil {
			status := http.StatusBadRequest
			if errors.Is(err, ErrExists) {
				status = http.StatusConflict
			}
			writeJSON(w, status, map[string]string{"error": err.Error()})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"bridged": strings.TrimSpace(spec.ID)})
	}))
	mux.HandleFunc("POST /workers/deregister", auth(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			ID string `json:"id"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&body); err != nil || body.ID == "" {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": `body must be {"id": worker}`})
			return
		}
		if err := b.Remove(r.Context(), body.ID, true); err != nil {
			writeJSON(w, http.StatusNotFound, map[string]string{"error": err.Error()})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"removed": body.ID})
	}))
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// CheckAPIListen applies the secure default to the bridge's HTTP API before
// it listens: off loopback (a wildcard or any other address) the
// register/deregister endpoints need a token, or insecure must say that
// they are open on purpose.
func CheckAPIListen(addr, token string, insecure bool) error {
	if addr == "" || token != "" || insecure || netaddr.LoopbackListen(addr) {
		return nil
	}
	return fmt.Errorf("bridge API on %s (off loopback) needs an API token: anyone who can reach it could register workers — give a token, listen on 127.0.0.1, or opt out explicitly (insecure)", addr)
}

// loopbackRemote says whether a request came from this host.
func loopbackRemote(remoteAddr string) bool {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
