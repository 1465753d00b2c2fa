/* Behaviour shared by the Models, Classes, Requests and Members pages (loaded by their templates).

   - htmx swaps 400/409/422 answers too: they carry the form again with its errors inline, so
     nothing the admin typed is lost; other errors show a message at the top of the page.
   - [data-clear="ID"] empties element ID instead of following the link (Cancel of an inline form).
   - [data-copy="ID"] copies element ID's text to the clipboard (the token shown once). */
(function () {
  "use strict";

  if (window.htmx) {
    htmx.config.responseHandling = [
      { code: "204", swap: false },
      { code: "[23]..", swap: true },
      { code: "(400|409|422)", swap: true, error: false },
      { code: "[45]..", swap: false, error: true },
      { code: "...", swap: false },
    ];
    document.body.addEventListener("htmx:responseError", function (event) {
      const xhr = event.detail.xhr;
      let text = "The server answered " + xhr.status + ".";
      if (xhr.status === 401 || xhr.status === 403) text = "Your session has ended or the form expired: reload the page and log in again.";
      else if (xhr.status === 429) text = "Too many requests: wait a moment and try again.";
      showError(text);
    });
    document.body.addEventListener("htmx:sendError", function () {
      showError("Hearth did not answer: is hearth serve still running?");
    });
  }

  function showError(text) {
    const main = document.querySelector(".main") || document.body;
    let box = document.getElementById("page-error");
    if (!box) {
      box = document.createElement("div");
      box.id = "page-error";
      box.className = "flash flash-bad";
      box.setAttribute("role", "alert");
      main.insertBefore(box, main.firstChild);
    }
    box.textContent = text;
  }

  document.addEventListener("click", function (event) {
    const clear = event.target.closest("[data-clear]");
    if (clear && window.htmx) {
      const target = document.getElementById(clear.dataset.clear);
      if (target) {
        event.preventDefault();
        target.innerHTML = "";
      }
      return;
    }
    const copy = event.target.closest("[data-copy]");
    if (copy) {
      event.preventDefault();
      const source = document.getElementById(copy.dataset.copy);
      if (!source) return;
      const text = source.textContent.trim();
      const done = function () {
        copy.textContent = "Copied";
        setTimeout(function () { copy.textContent = "Copy"; }, 2000);
      };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, function () { selectText(source); });
      } else {
        /* Plain http on the LAN has no clipboard API: select the token so Ctrl+C copies it. */
        selectText(source);
        copy.textContent = "Selected: press Ctrl+C";
      }
    }
  });

  function selectText(el) {
    const range = document.createRange();
    range.selectNodeContents(el);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }
})();
