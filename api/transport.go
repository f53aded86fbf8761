package api

import (
	"bytes"
	"net"
	"net/http"
	"time"
)

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// idleConnTimeout is below the keep-alive timeout of the engines' HTTP
// servers (uvicorn, which vLLM and SGLang run, closes idle connections
// after 5 s). A request sent on a connection the worker is closing at that
// moment fails after it was written, and the proxy loop never retries
// such a failure (the worker might have started generating); closing idle
// connections first keeps that race away.
const idleConnTimeout = 4 * time.Second

// newWorkerClient is the client to the workers: a short dial timeout so a
// dead worker is retried elsewhere quickly, no overall timeout (generations
// stream for minutes), idle connections kept for the next request.
func newWorkerClient(connect time.Duration) *http.Client {
	d := &net.Dialer{Timeout: connect, KeepAlive: 30 * time.Second}
	return &http.Client{Transport: &http.Transport{
		DialContext:           d.DialContext,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       idleConnTimeout,
		ResponseHeaderTimeout: 0,
		DisableCompression:    true, // relay bytes exactly as the worker sent them
	}}
}
